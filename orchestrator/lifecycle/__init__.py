"""The lifecycle shell: the job state machine and the work that moves jobs through it."""
