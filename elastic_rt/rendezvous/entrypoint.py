"""Target of the `torchrun.handlers` entry point; imports nothing of torch at load time.

torch loads entry points while its rendezvous package is still being imported, so the
handler module is imported lazily, when torchrun actually creates the handler.
"""

from __future__ import annotations


def etcd_v3_handler_factory():
    """torch calls this and registers what it returns as the creator of `etcd-v3` handlers."""

    def create_etcd_v3_handler(params):
        from elastic_rt.rendezvous.registration import create_etcd_v3_handler as create

        return create(params)

    return create_etcd_v3_handler
