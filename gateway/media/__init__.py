"""Media policy: URL checks, safe fetching, validation and inlining."""
