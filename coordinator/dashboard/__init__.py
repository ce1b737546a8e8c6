"""The coordinator's live web dashboard: snapshot of the cluster (domain) and its HTTP server."""
