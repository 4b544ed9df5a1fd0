"""What runs in each writer actor: ``SinkWriterActor`` (``writer``), its mailbox and the
watchdog of slow sink calls (see ``docs/architecture.md``)."""
