"""simcloud: the project's simulated cloud. A Lambda-compatible REST API whose instances are real SSH
endpoints on 127.0.0.1, with spot instances that get preempted (killing their processes)."""
