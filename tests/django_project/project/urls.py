from django.urls import include, path

urlpatterns = [path("ops/taskrunner/", include("taskrunner.contrib.django.urls"))]
