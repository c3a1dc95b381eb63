"""Spillway edge agent."""
