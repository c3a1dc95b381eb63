"""OTLP/HTTP metrics ingest: decoding, cumulative-to-delta conversion per stream, minute rollups."""

__all__ = ["deltas", "receiver", "store"]
