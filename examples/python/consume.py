"""A consumer of kube-event-bridge's Kafka topics with confluent-kafka and the CloudEvents
Python SDK 2 (``cloudevents.core.bindings.kafka`` reads binary and structured mode): it reads a topic from the
beginning, folds the stream into the current state of every object by message order, and
prints that state. Start from here: replace ``apply`` with what your service does.

    pip install -r requirements.txt
    python3 consume.py --brokers localhost:9092 --topic k8s.prod.core.configmaps

Events topics are read as CloudEvents (binary or structured mode, as each message's headers
say); a state topic (the object as the value, a tombstone for a delete) with ``--state``. Every
read is ``read_committed``: with ``exactly_once``, what an aborted transaction wrote is never
seen (on other topics it changes nothing).
"""

import argparse
import json
import sys
import time
import uuid

from cloudevents.core.bindings import kafka
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition


def apply(state, key, event):
    """Folds one event into ``state``: ``added``, ``updated`` and ``synced`` carry the object's
    new state, ``deleted`` removes it (seen on a watch or inferred by a list:
    ``k8sfinalstateunknown``). Messages of one key arrive in order, so the last one wins."""
    kind = event.get_type().rsplit(".", 1)[-1]
    data = event.get_data()
    if isinstance(data, (bytes, str)):
        data = json.loads(data)
    if kind in ("added", "updated", "synced"):
        state[key] = data["object"]
    elif kind == "deleted":
        state.pop(key, None)
    else:
        raise ValueError(f"{event.get_id()}: unknown type {event.get_type()}")


def read(message):
    """The CloudEvent an events topic's message holds, in binary or structured mode."""
    headers = {k.lower(): v for k, v in (message.headers() or [])}
    kafka_message = kafka.KafkaMessage(headers=headers, key=message.key(), value=message.value())
    if (headers.get("content-type") or b"").startswith(b"application/cloudevents"):
        return kafka.from_structured_event(kafka_message)
    return kafka.from_binary_event(kafka_message)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="localhost:9092")
    parser.add_argument("--topic", required=True)
    parser.add_argument(
        "--idle-exit",
        type=float,
        default=0,
        help="exit once no message came for this many seconds and print the state (0: run until interrupted)",
    )
    parser.add_argument(
        "--state",
        action="store_true",
        help="the topic is a state topic (mode: state): the object as the value, a tombstone for a delete",
    )
    args = parser.parse_args()
    consumer = Consumer(
        {
            "bootstrap.servers": args.brokers,
            # Partitions are assigned, not subscribed, and nothing is committed: the client
            # wants a group id all the same.
            "group.id": f"example-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    # Every partition from its beginning: the state is the whole topic's (each key's
    # messages are in one partition, in order).
    topic = consumer.list_topics(args.topic, timeout=30).topics[args.topic]
    if topic.error is not None:
        raise KafkaException(topic.error)
    consumer.assign([TopicPartition(args.topic, p, OFFSET_BEGINNING) for p in topic.partitions])
    state, messages = {}, 0
    idle_since = time.monotonic()
    try:
        while not args.idle_exit or time.monotonic() - idle_since < args.idle_exit:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error():
                raise KafkaException(message.error())
            idle_since = time.monotonic()
            messages += 1
            key = message.key().decode()
            if not args.state:
                apply(state, key, read(message))
            elif message.value() is None:
                # A tombstone: deleted. (The attributes are headers beside a state topic's
                # object, but the value is no event's data.)
                state.pop(key, None)
            else:
                state[key] = json.loads(message.value())
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    versions = {k: obj["metadata"]["resourceVersion"] for k, obj in sorted(state.items())}
    json.dump({"messages": messages, "state": versions}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
