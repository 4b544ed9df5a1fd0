"""What runs in the coordinator actor: ``CoordinatorActor`` (``coordinator``), the
two-phase commit (``epochs``, ``epoch_book``, ``recovery``, ``commits``), the continuous
stream's position, and the meta store where decisions live (``metastore``); see
``docs/architecture.md``."""
