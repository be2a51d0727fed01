"""`elastic-rt status`: one screen of a running job from its etcd keys and its agents' own endpoints."""
