"""Webhook notifications: subscriptions, signed CloudEvents deliveries, retries, dead letters, SSRF guard."""
