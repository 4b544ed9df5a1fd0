"""What runs in the driver and in producers: epochs fed, decided and recovered, feeds
for Ray tasks and actors, routing and sending data to writers, the continuous stream's
tick, and the life of the runtime's actors (see ``docs/architecture.md``)."""
