"""Test-wide fixtures: real services (RabbitMQ, PostgreSQL, moto S3) live in tests/fixtures."""

pytest_plugins = ["tests.fixtures.services", "tests.fixtures.cluster", "tests.fixtures.embedded"]
