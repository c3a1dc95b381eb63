"""OTLP/HTTP metrics ingest: decoding, legacy attribute names, histogram bounds, cumulative-to-delta conversion per
stream, minute rollups."""

__all__ = ["attributes", "bounds", "deltas", "receiver", "store"]
