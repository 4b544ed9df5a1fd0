"""Kafka sink: exactly-once records for ``read_committed`` readers, through
``confluent-kafka`` (librdkafka).

``from raysink.sinks import KafkaSink`` (or ``raysink.sinks.kafka.KafkaSink``). Each writer
slot owns one transactional producer; an epoch's records are produced at the writer's
pre-commit inside a transaction the writer keeps open, and committed by the writer when
the coordinator's commit asks it to. A transaction belongs to the producer instance that
opened it (librdkafka cannot resume or hand it over, and the prepared transactions of
two-phase-commit participation are not in the brokers or clients here), so a part whose
writer was lost after the decision is written again by the coordinator from the records
still in the log. ``docs/kafka.md`` gives the design, its alternatives and measurements.

Modules: ``_config`` (settings, names, refused producer settings), ``_encode`` (rows to
records), ``_progress`` (the progress topic, topic creation), ``_writer``
(``KafkaWriter``, in the writer actor), ``_sink`` (``KafkaSink``: the description and the
coordinator's calls), ``_replay`` (a lost part written again), ``_committer`` (the coordinator's
transactional producer: its takeover, a timed-out commit resumed, its errors),
``_failures`` (what a librdkafka error means: fencing, a missing ACL).
"""

from raysink.sinks.kafka._sink import KafkaSink
from raysink.sinks.kafka._writer import KafkaWriter

__all__ = ["KafkaSink", "KafkaWriter"]
