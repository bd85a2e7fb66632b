"""The cache-location view: pure fold from events to view operations, and its stores."""
