"""OTLP/HTTP metrics ingest: decoding, legacy attribute names, histogram bounds, the ingest log (exports durable
before the answer, replayed after a crash), cumulative-to-delta conversion against state in the database, minute
rollups."""

__all__ = ["applier", "attributes", "bounds", "deltas", "log", "receiver", "store"]
