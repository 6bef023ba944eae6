"""``path("admin/taskrunner/", include("taskrunner.contrib.django.urls"))``: the dashboard
(staff only) at that prefix, its metrics at ``metrics`` under it."""
from django.urls import path, re_path

from . import views

urlpatterns = [
    path("metrics", views.metrics, name="taskrunner-metrics"),
    re_path(r"^(?P<path>.*)$", views.dashboard, name="taskrunner-dashboard"),
]
