"""skillstats: exact stat counters in SQL from a Kafka topic of stat events."""

__version__ = "0.1.0"
