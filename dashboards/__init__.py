"""Spillway dashboards."""
