"""Pipeline stages as plain functions: config and inputs in, artifacts out.

Each module here is one stage of a recipe (ingest, tokenize, pack, train, verify,
evaluate, register). They know nothing about Metaflow, so a flow, a test or a notebook
can call them alike; flows in `flows/` only call them and store what they return.
Installed as `posttrain.steps`.
"""
