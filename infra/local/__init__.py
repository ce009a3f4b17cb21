"""What runs on this machine: the room every other room of infra may build on.

- `stack`: a real Redis and a real S3 server as child processes (`LocalStack`, `diloco stack`).
- `certs`: the CA and server certificate of a Redis that speaks TLS only.
- `fleet`: one process in its own process group (`Proc`) and the command lines of `diloco` processes.
- `docker-compose.yml`: Redis + MinIO for people with Docker.
- `cli`: `diloco stack up|down|env`.
"""
