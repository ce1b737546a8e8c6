"""Uploaded data sets.

The content-addressed store and the checks a data set passes before a job may use it
(docs/architecture.md, "Data sets").
"""
