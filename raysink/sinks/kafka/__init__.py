"""Kafka sink: exactly-once records for ``read_committed`` readers, through
``confluent-kafka`` (librdkafka).

``from raysink.sinks import KafkaSink`` (or ``raysink.sinks.kafka.KafkaSink``). Each writer
slot owns one transactional producer; an epoch's records are produced at the writer's
pre-commit (or, with ``early_start_records`` set, from that many records on)
inside a transaction the writer keeps open, and committed by the writer when
the coordinator's commit asks it to. A transaction belongs to the producer instance that
opened it (librdkafka cannot resume or hand it over, and the prepared transactions of
two-phase-commit participation are not in the brokers or clients here), so a part whose
writer was lost after the decision is written again by the coordinator from the records
still in the log. ``docs/kafka.md`` gives the design, its alternatives and measurements.

The modules, in layers: each imports only those below it (``_sink`` runs in the
coordinator, ``_writer`` in each writer actor)::

    _sink        KafkaSink: the description and the coordinator's calls (commit, abort,
                 markers, a marker held back healed)
    _writer      KafkaWriter: one writer slot's transactional producer
    _takeover    a new producer's transactional id taken over, in a thread
    _produced    one transaction's records sent so far (begun at the pre-commit or early),
                 or with a delivery report per record
    _batches     an epoch's records placed and produced by partition, their offset runs
                 from two delivery reports per chunk (or the chunk read back)
    _replay      a lost part written again, from the log, in bounded chunks
    _hanging     a transaction left open on the progress partition: found, named, ended
    _roles       what the modules above need of KafkaSink, as protocols
    _committer   the coordinator's transactional producer: its takeover, a timed-out
                 commit resumed, its errors
    _progress    the progress topic (epoch and part records), topic creation
    _failures    what a librdkafka error means: fencing, a missing ACL
    _encode      rows to records
    _avro        rows to Avro record values, column-wise
    _avroschema  an Avro record schema read and checked, defaults encoded
    _wire        the requests librdkafka lacks (DescribeProducers, WriteTxnMarkers, Fetch)
    _config      settings, names, refused producer settings, the client module
"""

from raysink.sinks.kafka._sink import KafkaSink
from raysink.sinks.kafka._writer import KafkaWriter

__all__ = ["KafkaSink", "KafkaWriter"]
