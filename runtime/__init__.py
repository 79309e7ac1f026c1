"""The actor runtime: NATS bus, message codec, actors, supervisor, configuration, storage, event logs.

It knows nothing of RL: actors/ builds the trainer on top of it.
"""
