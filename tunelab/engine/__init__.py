"""The collective engine: topology, transports, fusion and allreduce algorithms."""
