"""Policy documents: what the control plane tells one agent to do, and how the agent applies them.

`document` (the schema, shared with the control plane), `plan` (a document checked against the served models),
`apply` (moving the running agent to a new policy), `cache` (the last good document on disk), `client` (polling
the control plane). The package itself imports none of them, so the control plane can import the schema alone.
"""
