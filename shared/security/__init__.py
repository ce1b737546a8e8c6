"""Who may connect, who may do what, and what a job may make a daemon touch.

Modules: ``auth`` (roles and what each may call), ``tokens`` (Ed25519-signed JWTs),
``certs`` (development certificates), ``transport`` (mutual TLS and tokens on channels and
servers), ``dev`` (a local secure cluster's files), ``exposure`` (refusing to listen openly by
accident) and ``confinement`` (allowed imports and data paths of job specs).
"""
