"""The consumers: one module per consumer group."""
