"""Benchmarks of amqp-locks against a private RabbitMQ node (`python -m benchmarks.run`)."""
