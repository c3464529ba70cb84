"""The carma daemon: state store, process executor, HTTP API on a unix socket, and its client."""
