"""Storage: ORM tables, engines and sessions, and Alembic migrations."""

from controlplane.db.migrate import downgrade_to, migrate_to
from controlplane.db.models import Agent, ApiKey, Backend, Base, Event, MetricRollup, Rule, Slo, utcnow
from controlplane.db.session import make_engine, make_sessionmaker, normalise_url, transaction

__all__ = [
    "Agent",
    "ApiKey",
    "Backend",
    "Base",
    "Event",
    "MetricRollup",
    "Rule",
    "Slo",
    "downgrade_to",
    "make_engine",
    "make_sessionmaker",
    "migrate_to",
    "normalise_url",
    "transaction",
    "utcnow",
]
