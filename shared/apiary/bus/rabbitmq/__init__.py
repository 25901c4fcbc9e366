"""The bus on RabbitMQ (the only package that imports aio-pika), split by role.

- `broker`: `RabbitBus`, the port's operations composed from the parts below;
- `connection`: the robust connection, its confirming channel and the exchange;
- `topology`: queue names and declarations (port queues, a queue per delay, hold queues);
- `publisher`: mandatory publishes with confirms, waiting out a reconnect; dead letters;
- `subscriber`: consumers that run the handler and ack, requeue or dead-letter as `judge` says;
- `rehold`: keeping a long handler's delivery past the broker's consumer acknowledgement timeout;
- `wire`: between the port's `Delivery` and AMQP messages.
"""

from apiary.bus.rabbitmq.broker import RabbitBus

__all__ = ["RabbitBus"]
