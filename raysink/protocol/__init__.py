"""What every process of a runtime shares: the messages and answers they send each other,
the typed clients of the actors' calls, checkpoint barriers and their alignment, and
vnodes (see ``docs/architecture.md``)."""
