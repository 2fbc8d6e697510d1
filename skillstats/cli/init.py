"""`skillstats init`: the topics and the SQL schema, idempotent; an events topic that would lose events refused."""

from __future__ import annotations

import argparse
import sys

from skillstats.cli.common import EXIT_OK, UsageError, database_options, kafka_options, positive, verbosity
from skillstats.config import FIRST_ANSWER_S, Settings, redact_url


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Create the events and DLQ topics through the Kafka admin API and bring the SQL schema to the newest "
        "migration. Safe to run again: existing topics and tables are left as they are. An existing events topic "
        "whose cleanup.policy is not delete (compaction drops events nobody counted) is refused, exit 2."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    parser.add_argument("--partitions", type=positive, default=12, help="partitions of the events topic (default 12)")
    parser.add_argument("--dlq-partitions", type=positive, default=3, help="partitions of the DLQ topic (default 3)")
    parser.add_argument(
        "--replication-factor",
        type=positive,
        default=-1,
        help="replication factor (default: the broker's default.replication.factor)",
    )
    parser.add_argument(
        "--timeout", type=float, default=FIRST_ANSWER_S, help="seconds to wait for Kafka (default %(default)g)"
    )
    parser.add_argument("--skip-topics", action="store_true", help="only migrate the SQL schema")
    parser.add_argument(
        "--new-topic",
        action="store_true",
        help="create the events topic even though the database counts another one (a new deployment on purpose; "
        "without it a topic the database does not count is refused, since a typo would leave publishers writing "
        "to a topic no consumer reads)",
    )
    parser.add_argument("--skip-schema", action="store_true", help="only create the topics")
    parser.add_argument(
        "--demo-registry",
        action="store_true",
        help="also give the skills `publish --demo` publishes for (sk_000000...) rows in the registry's skills "
        "table, where they have none, so that docsync has rows to update; for demo stacks without a registry",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.demo_registry and args.skip_schema:
        raise UsageError("--demo-registry writes to the database: not with --skip-schema")
    # The database first: a wrong URL must not leave topics created behind a failed init.
    if not args.skip_schema:
        from skillstats.sinks.db import open_engine
        from skillstats.sinks.migrate import upgrade

        engine = open_engine(settings.database_url)
        before, after = upgrade(engine)
        state = "up to date" if before == after else f"migrated {before or 'empty'} -> {after}"
        print(f"schema {redact_url(settings.database_url)}: {state}")
        if args.demo_registry:
            from skillstats.sinks.docstats import register_missing_skills
            from skillstats.workload import demo_registry

            with engine.begin() as connection:
                added = register_missing_skills(connection, demo_registry())
            print(f"demo registry: {added} skill row(s) added, {len(demo_registry()) - added} already there")
    if not args.skip_topics:
        from skillstats.dlq import DLQ_TOPIC_CONFIG
        from skillstats.dlq_admin import LEDGER_CONFIG, ledger_topic
        from skillstats.kafka import (
            CLEANUP_POLICY,
            TIMESTAMP_TYPE,
            ensure_topics,
            topic_config_problems,
            topic_configs,
        )

        _refuse_uncounted_topic(settings, args.new_topic, args.timeout)
        reports = ensure_topics(
            settings,
            # The replay ledger too (dlq replay would create it on demand): one compacted partition.
            {settings.topic: args.partitions, settings.dlq_topic: args.dlq_partitions, ledger_topic(settings): 1},
            configs={
                settings.dlq_topic: DLQ_TOPIC_CONFIG,
                settings.topic: {CLEANUP_POLICY: "delete"},
                ledger_topic(settings): LEDGER_CONFIG,
            },
            replication_factor=args.replication_factor,
            timeout=args.timeout,
        )
        for report in reports:
            state = "created" if report.created else "exists"
            print(f"topic {report.name}: {state}, {report.partitions} partitions (on {settings.kafka_bootstrap})")
        problems = topic_config_problems(
            topic_configs(settings, settings.topic, (CLEANUP_POLICY, TIMESTAMP_TYPE), args.timeout)
        )
        refusals = [p for p in problems if p.startswith(CLEANUP_POLICY)]
        for problem in problems:
            if problem not in refusals:
                print(f"note: topic {settings.topic}: {problem}", file=sys.stderr)
        if refusals:
            raise UsageError(f"topic {settings.topic}: {refusals[0]}")
    return EXIT_OK


def _refuse_uncounted_topic(settings: Settings, new_topic: bool, timeout: float) -> None:
    """Refuse to create an events topic beside the one this database counts (unless --new-topic).

    `init` is what a "topic does not exist" hint sends people to: with a typo in
    SKILLSTATS_TOPIC it would create the misspelt topic, and every later publish
    would succeed into a topic no consumer of this database reads.
    """
    from skillstats.cli.common import counted_topics
    from skillstats.kafka import list_topic_names

    counted = counted_topics(settings)
    if new_topic or not counted or settings.topic in counted:
        return
    if settings.topic in list_topic_names(settings, timeout):
        return  # exists already: nothing is created (the consumers check the topic they are set to read)
    named = ", ".join(f"{topic!r} ({', '.join(roles)})" for topic, roles in sorted(counted.items()))
    raise UsageError(
        f"the database {redact_url(settings.database_url)} counts topic {named}, and topic {settings.topic!r} "
        f"does not exist: not creating it, since publishers would then write to a topic no consumer of this "
        f"database reads. Check SKILLSTATS_TOPIC (--topic); for a new topic on purpose, add --new-topic"
    )
