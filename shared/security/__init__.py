"""Who may do what: ``auth`` (roles and what each may call), ``tokens`` (Ed25519 tokens),
``certs`` (certificates), ``transport`` (TLS and tokens on channels and servers), ``dev``
(a local secure cluster's files), ``exposure`` (refusing to listen openly by accident) and
``confinement`` (allowed imports and data paths)."""
