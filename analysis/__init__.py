"""Parsers, analyzers and the report. Never imports torch."""
