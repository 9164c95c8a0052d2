"""Who may do what: the endpoint table, API keys and their scopes, per-request permissions,
and admission (rate limits and in-flight caps)."""
