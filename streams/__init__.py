"""The Faust app, topic declarations and the agents that fold events into the view."""
