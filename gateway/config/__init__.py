"""Settings: the typed model, where its values come from (environment, YAML file), and
the TLS contexts built from them."""
