"""A real local etcd (one member or a cluster; TLS and auth) for the tests and the benchmarks: not part of the
installed package (setuptools ships elastic_rt* only). Import it with the repository root on sys.path."""
