"""Reaching burst instances: SSH with pinned host keys (`ssh`), checkpoint and workdir sync (`sync`), S3 (`s3store`)."""
