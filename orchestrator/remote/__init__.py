"""Reaching burst instances: SSH with pinned host keys (`ssh`), checkpoint and workdir sync (`sync`).

S3 checkpoints live in `runbooks.s3_checkpoints`: the instance uploads them, so that module runs there too."""
