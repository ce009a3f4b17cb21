"""What runs on this machine: the room under demo, chaos and bench (tests/unit/test_layering.py).

- `stack`: a real Redis and a real S3 server as child processes (`LocalStack`, `diloco stack`).
- `certs`: the CA and server certificate of a Redis that speaks TLS only.
- `fleet`: the one process supervisor: `Proc` (a process in its own group, the servers' too), `Supervisor`
  (a run's named processes: start, watch, kill, restart, stop) and `learner_argv`.
- `docker-compose.yml`: Redis + MinIO for people with Docker.
- `cli`: `diloco stack up|down|env`.
"""
