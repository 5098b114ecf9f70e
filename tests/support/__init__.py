"""Test doubles shared by the test tiers and the benchmark scripts: stand-in SGLang servers for the router
(`router_standin`), a scripted OpenAI server for the load generator (`loadgen_standin`), the in-process fake
data plane (`fake_transport`) and a transport side in a child process (`transport`).

They live here, not in the installed packages, because nothing in production runs them. Import them as
`tests.support.<module>` with the repository root on `sys.path` (pytest puts it there; scripts insert it).
"""
