"""`orbit serve`: the Tinker API (the `tinker` SDK, tinker-cookbook) on Orbit's own engines and
trainer. The wire (app.py: the routes; bodies.py: the JSON requests; wire.py: the protocol
buffers, tinker.proto), the service
behind it (service.py), training clients on one base (clients.py, their losses in losses.py, their
turns on the trainer in training.py), sampling from slots (samplers.py), futures (futures.py), and
the command (command.py). docs/tinker.md says how to use it."""
