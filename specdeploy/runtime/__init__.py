"""Running engines: the batch decoder, the engine that loads a built directory, the continuous-batching scheduler."""
