// A consumer of kube-event-bridge's Kafka topics built on the CloudEvents Go SDK
// (github.com/cloudevents/sdk-go/v2 with its Sarama binding): it reads a topic from the
// beginning, folds the stream into the current state of every object by message order, and
// prints that state. Start from here: replace `apply` with what your service does.
//
//	go run . -brokers localhost:9092 -topic k8s.prod.core.configmaps
//
// Events topics are read as CloudEvents (binary or structured mode, as each message's headers
// say); a state topic (the object as the value, a tombstone for a delete) with -state.
// Every read is `read_committed`: with `exactly_once`, what an aborted transaction wrote is
// never seen (on other topics it changes nothing).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/IBM/sarama"
	"github.com/cloudevents/sdk-go/protocol/kafka_sarama/v2"
	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/types"
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
	flag.Parse()
	if *topic == "" {
		fmt.Fprintln(os.Stderr, "-topic is required")
		os.Exit(2)
	}
	if err := run(strings.Split(*brokers, ","), *topic, *idle, *events, *stateTopic); err != nil {
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
				if err := out.Encode(describe(m, ev)); err != nil {
					return err
				}
			}
			if err := s.apply(key, ev); err != nil {
				return err
			}
		case <-timeout:
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
			return out.Encode(map[string]any{"messages": n, "state": versions})
		}
	}
}

// describe: every attribute with its CloudEvents type as the SDK holds it, and the data.
func describe(m *sarama.ConsumerMessage, ev *event.Event) map[string]any {
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
		"partition":  m.Partition,
		"offset":     m.Offset,
		"attributes": attributes,
		"data":       json.RawMessage(ev.Data()),
	}
}
