/* The sandbox ("pause") container of the real node's pods: it holds the pod's namespaces open, reaps the zombies
 * re-parented to it when the pod shares one PID namespace, and exits on SIGINT or SIGTERM. Kubernetes' own pause
 * image does the same; it is built here because no registry is reachable to pull it from. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) { _exit(signo == SIGTERM || signo == SIGINT ? 0 : 2); }

static void reap(int signo) {
  (void)signo;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop}, on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (getpid() != 1) fprintf(stderr, "pause: not PID 1, zombies are reaped only in a shared PID namespace\n");
  if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
      sigaction(SIGCHLD, &on_child, NULL) < 0)
    return 1;
  for (;;) pause();
}
