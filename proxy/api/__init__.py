"""HTTP routes: one folder per endpoint family, each translating its wire format into the
service's ``TurnRequest`` and back."""
