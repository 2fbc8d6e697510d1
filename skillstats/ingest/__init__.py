"""`skillstats ingest`: the event contract at the HTTP edge, for services that cannot hold a Kafka connection.

`body` turns a request body into records or the reasons it cannot (the
contract's own decoder, the DLQ's reasons); `tokens` checks the bearer token;
`idempotency` remembers answered requests in SQL; `receipts` writes each keyed
request's answer into its own Kafka transaction and reads it back for a request
that takes over a key after a crash; `transactions` publishes the records of many
requests in one Kafka transaction each; `refusals` logs the requests answered
4xx, rate-limited; `server` is the aiohttp application that ties them together,
with its probes and metrics.
"""

# Of the shutdown budget, kept for closing connections and the producer after the requests in flight are
# answered (here, not in `server`, so that the command line can check a budget without importing aiohttp).
DRAIN_RESERVE_S = 2.0
