"""Generated from proto/warden/v1 by tools/gen_protos.py: do not edit.

The Warden contract as Python modules: ``<name>_pb2`` (messages) and ``<name>_pb2_grpc``
(stubs and servicers) for each of common, ledger, planner, policy, runs and toolhost.
"""
