"""Test-only helpers shared by the test modules (never imported by the product)."""
