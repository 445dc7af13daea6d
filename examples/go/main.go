// A consumer of kube-event-bridge's Kafka topics (or NATS JetStream streams) built on the
// CloudEvents Go SDK (github.com/cloudevents/sdk-go/v2 with its Sarama and NATS JetStream
// bindings): it reads a topic (or stream) from the beginning, folds the stream into the
// current state of every object by message order, and prints that state. Start from here:
// replace `apply` with what your service does.
//
//	go run . -brokers localhost:9092 -topic k8s.prod.core.configmaps
//	go run . -nats nats://localhost:4222 -stream KUBE_EVENTS
//
// Events topics are read as CloudEvents (binary or structured mode, as each message's headers
// say); a state topic (the object as the value, a tombstone for a delete) with -state.
// Every read is `read_committed`: with `exactly_once`, what an aborted transaction wrote is
// never seen (on other topics it changes nothing).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/cloudevents/sdk-go/protocol/kafka_sarama/v2"
	"github.com/cloudevents/sdk-go/protocol/nats_jetstream/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/types"
	"github.com/nats-io/nats.go"
)

// The object's state as folded so far, by key (`namespace/name`, or `name`).
type state map[string]json.RawMessage

// apply folds one event into the state: `added`, `updated` and `synced` carry the object's
// new state, `deleted` removes it (whether seen on a watch or inferred by a list:
// `k8sfinalstateunknown`). Messages of one key arrive in order, so the last one wins.
func (s state) apply(key string, ev *event.Event) error {
	var data struct {
		Object json.RawMessage `json:"object"`
	}
	if err := json.Unmarshal(ev.Data(), &data); err != nil {
		return fmt.Errorf("%s: data is not the bridge's JSON: %w", ev.ID(), err)
	}
	switch ev.Type()[strings.LastIndex(ev.Type(), ".")+1:] {
	case "added", "updated", "synced":
		s[key] = data.Object
	case "deleted":
		delete(s, key)
	default:
		return fmt.Errorf("%s: unknown type %s", ev.ID(), ev.Type())
	}
	return nil
}

func main() {
	brokers := flag.String("brokers", "localhost:9092", "Kafka bootstrap servers, comma-separated")
	topic := flag.String("topic", "", "the topic to read (required)")
	idle := flag.Duration("idle-exit", 0, "exit once no message came for this long and print the state (0: run until interrupted)")
	events := flag.Bool("print-events", false, "print each event's attributes (with their CloudEvents types) and data as the SDK read them")
	stateTopic := flag.Bool("state", false, "the topic is a state topic (mode: state): the object as the value, a tombstone for a delete")
	natsURL := flag.String("nats", "", "read the JetStream stream -stream on this NATS server instead of Kafka")
	stream := flag.String("stream", "", "with -nats: the stream (required)")
	flag.Parse()
	var err error
	switch {
	case *natsURL != "" && *stream != "":
		err = runNATS(*natsURL, *stream, *idle, *events)
	case *natsURL != "":
		fmt.Fprintln(os.Stderr, "-stream is required with -nats")
		os.Exit(2)
	case *topic == "":
		fmt.Fprintln(os.Stderr, "-topic (or -nats and -stream) is required")
		os.Exit(2)
	default:
		err = run(strings.Split(*brokers, ","), *topic, *idle, *events, *stateTopic)
	}
	if err != nil {
		log.Fatal(err)
	}
}

func run(brokers []string, topic string, idle time.Duration, events, stateTopic bool) error {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V3_0_0_0
	cfg.Consumer.IsolationLevel = sarama.ReadCommitted
	cfg.Consumer.Return.Errors = true
	consumer, err := sarama.NewConsumer(brokers, cfg)
	if err != nil {
		return fmt.Errorf("connecting to %v: %w", brokers, err)
	}
	defer consumer.Close()
	partitions, err := consumer.Partitions(topic)
	if err != nil {
		return fmt.Errorf("topic %s: %w", topic, err)
	}
	// Each partition in order; a key always lands on the same one.
	messages := make(chan *sarama.ConsumerMessage)
	var wg sync.WaitGroup
	for _, p := range partitions {
		pc, err := consumer.ConsumePartition(topic, p, sarama.OffsetOldest)
		if err != nil {
			return fmt.Errorf("topic %s partition %d: %w", topic, p, err)
		}
		defer pc.AsyncClose()
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range pc.Messages() {
				messages <- m
			}
		}()
		go func() {
			for e := range pc.Errors() {
				log.Printf("partition %d: %v", p, e)
			}
		}()
	}
	s := state{}
	out := json.NewEncoder(os.Stdout)
	n := 0
	timeout := make(<-chan time.Time)
	for {
		if idle > 0 {
			timeout = time.After(idle)
		}
		select {
		case m := <-messages:
			n++
			key := string(m.Key)
			if stateTopic {
				// The object, or a tombstone for a delete (the attributes are headers
				// beside it, but the value is no event's data).
				if m.Value == nil {
					delete(s, key)
				} else {
					s[key] = json.RawMessage(m.Value)
				}
				continue
			}
			ev, err := binding.ToEvent(context.Background(), kafka_sarama.NewMessageFromConsumerMessage(m))
			if err != nil {
				return fmt.Errorf("partition %d offset %d: not a CloudEvent: %w", m.Partition, m.Offset, err)
			}
			if err := ev.Validate(); err != nil {
				return fmt.Errorf("partition %d offset %d: invalid CloudEvent: %w", m.Partition, m.Offset, err)
			}
			if events {
				if err := out.Encode(describe(m.Partition, m.Offset, ev)); err != nil {
					return err
				}
			}
			if err := s.apply(key, ev); err != nil {
				return err
			}
		case <-timeout:
			return s.print(out, n)
		}
	}
}

// runNATS: the same over a JetStream stream, from its first message (an ordered consumer of
// every subject). The key is the event's subject (`namespace/name`).
func runNATS(url, stream string, idle time.Duration, events bool) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return fmt.Errorf("connecting to %s: %w", url, err)
	}
	defer nc.Close()
	js, err := nc.JetStream()
	if err != nil {
		return err
	}
	sub, err := js.SubscribeSync(">", nats.BindStream(stream), nats.OrderedConsumer(), nats.DeliverAll())
	if err != nil {
		return fmt.Errorf("stream %s: %w", stream, err)
	}
	defer sub.Unsubscribe()
	s := state{}
	out := json.NewEncoder(os.Stdout)
	n := 0
	for {
		wait := idle
		if wait == 0 {
			wait = time.Hour
		}
		m, err := sub.NextMsg(wait)
		if errors.Is(err, nats.ErrTimeout) && idle > 0 {
			return s.print(out, n)
		} else if errors.Is(err, nats.ErrTimeout) {
			continue
		} else if err != nil {
			return err
		}
		n++
		meta, err := m.Metadata()
		if err != nil {
			return err
		}
		ev, err := binding.ToEvent(context.Background(), nats_jetstream.NewMessage(m))
		if err != nil {
			return fmt.Errorf("stream sequence %d: not a CloudEvent: %w", meta.Sequence.Stream, err)
		}
		if err := ev.Validate(); err != nil {
			return fmt.Errorf("stream sequence %d: invalid CloudEvent: %w", meta.Sequence.Stream, err)
		}
		if events {
			if err := out.Encode(describe(0, int64(meta.Sequence.Stream), ev)); err != nil {
				return err
			}
		}
		if err := s.apply(ev.Subject(), ev); err != nil {
			return err
		}
	}
}

// print writes what the state holds: each key's resourceVersion.
func (s state) print(out *json.Encoder, messages int) error {
	versions := map[string]string{}
	for k, obj := range s {
		var o struct {
			Metadata struct {
				ResourceVersion string `json:"resourceVersion"`
			} `json:"metadata"`
		}
		_ = json.Unmarshal(obj, &o)
		versions[k] = o.Metadata.ResourceVersion
	}
	return out.Encode(map[string]any{"messages": messages, "state": versions})
}

// describe: every attribute with its CloudEvents type as the SDK holds it, and the data, of
// the message at `offset` of `partition` (NATS: the stream sequence, partition 0).
func describe(partition int32, offset int64, ev *event.Event) map[string]any {
	attributes := map[string]any{}
	put := func(name string, value any) {
		t, v := "String", ""
		switch x := value.(type) {
		case string:
			v = x
		case bool:
			t, v = "Boolean", fmt.Sprint(x)
		case int32:
			t, v = "Integer", fmt.Sprint(x)
		case types.URI:
			t, v = "URI", x.String()
		case types.URIRef:
			t, v = "URI-reference", x.String()
		case *types.URIRef:
			t, v = "URI-reference", x.String()
		case types.Timestamp:
			t, v = "Timestamp", x.Time.UTC().Format(time.RFC3339Nano)
		case *types.Timestamp:
			t, v = "Timestamp", x.Time.UTC().Format(time.RFC3339Nano)
		case []byte:
			t, v = "Binary", string(x)
		default:
			t, v = fmt.Sprintf("%T", x), fmt.Sprint(x)
		}
		attributes[name] = map[string]string{"type": t, "value": v}
	}
	c := ev.Context.AsV1()
	put("specversion", ev.SpecVersion())
	put("id", c.ID)
	put("source", c.Source)
	put("type", c.Type)
	if c.Subject != nil {
		put("subject", *c.Subject)
	}
	if c.Time != nil {
		put("time", c.Time)
	}
	if c.DataContentType != nil {
		put("datacontenttype", *c.DataContentType)
	}
	for name, value := range c.Extensions {
		put(name, value)
	}
	return map[string]any{
		"partition":  partition,
		"offset":     offset,
		"attributes": attributes,
		"data":       json.RawMessage(ev.Data()),
	}
}
