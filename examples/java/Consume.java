// A consumer of kube-event-bridge's Kafka topics built on the CloudEvents Java SDK
// (io.cloudevents:cloudevents-kafka, whose CloudEventDeserializer reads binary and structured
// mode, with cloudevents-json-jackson): it reads a topic from the beginning, folds the stream
// into the current state of every object by message order, and prints that state. Start from
// here: replace `apply` with what your service does.
//
//   java -cp 'target/jars/*' Consume.java --brokers localhost:9092 --topic k8s.prod.core.configmaps
//
// Events topics are read as CloudEvents; a state topic (the object as the value, a tombstone
// for a delete) is read with --state. Every read is read_committed: with `exactly_once`, what
// an aborted transaction wrote is never seen (on other topics it changes nothing).

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import io.cloudevents.CloudEvent;
import io.cloudevents.kafka.CloudEventDeserializer;
import java.net.URI;
import java.time.Duration;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.TreeMap;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.Deserializer;
import org.apache.kafka.common.serialization.StringDeserializer;

public class Consume {
    static final ObjectMapper JSON = new ObjectMapper();

    /** The objects' state as folded so far, by key (`namespace/name`, or `name`). */
    static final Map<String, JsonNode> state = new TreeMap<>();

    /**
     * Folds one event into the state: `added`, `updated` and `synced` carry the object's new
     * state, `deleted` removes it (seen on a watch or inferred by a list:
     * `k8sfinalstateunknown`). Messages of one key arrive in order, so the last one wins.
     */
    static void apply(String key, CloudEvent event) throws Exception {
        String type = event.getType().substring(event.getType().lastIndexOf('.') + 1);
        JsonNode data = JSON.readTree(event.getData().toBytes());
        switch (type) {
            case "added", "updated", "synced" -> state.put(key, data.get("object"));
            case "deleted" -> state.remove(key);
            default -> throw new IllegalArgumentException(event.getId() + ": unknown type " + event.getType());
        }
    }

    public static void main(String[] args) throws Exception {
        String brokers = "localhost:9092", topic = null;
        Duration idleExit = null;
        boolean printEvents = false, stateTopic = false;
        for (int i = 0; i < args.length; i++) {
            switch (args[i]) {
                case "--brokers" -> brokers = args[++i];
                case "--topic" -> topic = args[++i];
                case "--idle-exit" -> idleExit = Duration.ofMillis((long) (Double.parseDouble(args[++i]) * 1000));
                case "--print-events" -> printEvents = true;
                case "--state" -> stateTopic = true;
                default -> {
                    System.err.println("unknown argument " + args[i]
                        + " (--brokers B --topic T [--state] [--idle-exit SECONDS] [--print-events])");
                    System.exit(2);
                }
            }
        }
        if (topic == null) {
            System.err.println("--topic is required");
            System.exit(2);
        }
        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, brokers);
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, "false");
        props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        Deserializer<?> values = stateTopic ? new ByteArrayDeserializer() : new CloudEventDeserializer();
        int messages = 0;
        try (KafkaConsumer<String, ?> consumer = new KafkaConsumer<>(props, new StringDeserializer(), values)) {
            // Every partition from its beginning, without a group: the state is the whole
            // topic's (each key's messages are in one partition, in order).
            List<TopicPartition> partitions = consumer.partitionsFor(topic).stream()
                .map(p -> new TopicPartition(p.topic(), p.partition()))
                .toList();
            consumer.assign(partitions);
            consumer.seekToBeginning(partitions);
            long idleSince = System.nanoTime();
            while (idleExit == null || System.nanoTime() - idleSince < idleExit.toNanos()) {
                var records = consumer.poll(Duration.ofMillis(200));
                if (!records.isEmpty()) {
                    idleSince = System.nanoTime();
                }
                for (ConsumerRecord<String, ?> record : records) {
                    messages++;
                    if (stateTopic) {
                        byte[] value = (byte[]) record.value();
                        if (value == null) {
                            state.remove(record.key());
                        } else {
                            state.put(record.key(), JSON.readTree(value));
                        }
                        continue;
                    }
                    CloudEvent event = (CloudEvent) record.value();
                    if (printEvents) {
                        System.out.println(JSON.writeValueAsString(describe(record, event)));
                    }
                    apply(record.key(), event);
                }
            }
        }
        Map<String, String> versions = new TreeMap<>();
        state.forEach((key, obj) -> versions.put(key, obj.path("metadata").path("resourceVersion").asText()));
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("messages", messages);
        out.put("state", versions);
        System.out.println(JSON.writeValueAsString(out));
    }

    /** Every attribute with its CloudEvents type as the SDK holds it, and the data. */
    static Map<String, Object> describe(ConsumerRecord<String, ?> record, CloudEvent event) throws Exception {
        Map<String, Object> attributes = new TreeMap<>();
        for (String name : event.getAttributeNames()) {
            if (event.getAttribute(name) != null) {
                attributes.put(name, typed(event.getAttribute(name)));
            }
        }
        for (String name : event.getExtensionNames()) {
            if (event.getExtension(name) != null) {
                attributes.put(name, typed(event.getExtension(name)));
            }
        }
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("partition", record.partition());
        out.put("offset", record.offset());
        out.put("attributes", attributes);
        out.put("data", event.getData() == null ? null : JSON.readTree(event.getData().toBytes()));
        return out;
    }

    static Map<String, String> typed(Object value) {
        String type, text;
        if (value instanceof String s) {
            type = "String"; text = s;
        } else if (value instanceof Boolean b) {
            type = "Boolean"; text = b.toString();
        } else if (value instanceof Integer n) {
            type = "Integer"; text = n.toString();
        } else if (value instanceof URI u) {
            type = u.isAbsolute() ? "URI" : "URI-reference"; text = u.toString();
        } else if (value instanceof OffsetDateTime t) {
            type = "Timestamp"; text = t.withOffsetSameInstant(ZoneOffset.UTC).format(DateTimeFormatter.ISO_OFFSET_DATE_TIME);
        } else if (value instanceof io.cloudevents.SpecVersion v) {
            type = "String"; text = v.toString();
        } else if (value instanceof byte[] b) {
            type = "Binary"; text = new String(b);
        } else {
            type = value == null ? "null" : value.getClass().getSimpleName(); text = String.valueOf(value);
        }
        Map<String, String> out = new LinkedHashMap<>();
        out.put("type", type);
        out.put("value", text);
        return out;
    }
}
