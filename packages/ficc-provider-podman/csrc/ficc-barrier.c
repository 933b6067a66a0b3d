/*
 * ficc-barrier: the trusted first executable of every payload.
 *
 * It is started by the runtime as the container's entrypoint and does nothing
 * until the host, having inspected this live process (uid/gid, capabilities,
 * NoNewPrivs, seccomp, cgroup, namespaces, rlimits, fds, mounts, and that
 * /proc/PID/exe is this very file), writes the release marker. Only then does it
 * execve() the payload argv. It never follows a link to the marker, never reads
 * more than the token's length, and exits with a distinct code on any anomaly so
 * the host can tell what went wrong.
 *
 * usage: ficc-barrier MARKER TOKEN -- ARGV0 [ARG...]
 *   MARKER  absolute path of the release marker (inside a directory the host owns)
 *   TOKEN   the exact bytes the marker must contain (the attempt id)
 *   ARGV0   absolute path of the payload program
 *
 * Built static (no dynamic loader) so no library or loader path can be swapped
 * under it between the host's check and the exec.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    EXIT_USAGE = 120,         /* bad arguments: the provider built a wrong argv */
    EXIT_MARKER_UNSAFE = 121, /* marker is a link, not a regular file, or too big */
    EXIT_MARKER_TOKEN = 122,  /* marker exists but holds another token */
    EXIT_WAIT_FAILED = 123,   /* the wait itself failed (inotify/poll error) */
    EXIT_EXEC_FAILED = 124,   /* execve of the payload failed */
};

#define TOKEN_MAX 128

static void say(const char *msg) {
    ssize_t ignored = write(STDERR_FILENO, msg, strlen(msg));
    (void)ignored;
}

/* 0: not there yet; 1: released; otherwise an exit code. */
static int check_marker(const char *marker, const char *token) {
    int fd = open(marker, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        if (errno == ENOENT) return 0;
        say("ficc-barrier: marker cannot be opened safely (link or unreadable)\n");
        return EXIT_MARKER_UNSAFE;
    }
    struct stat st;
    size_t want = strlen(token);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (off_t)want) {
        close(fd);
        say("ficc-barrier: marker is not a regular file of the expected size\n");
        return EXIT_MARKER_UNSAFE;
    }
    if (st.st_size < (off_t)want) {
        /* Still being written (the host may write in place): keep waiting. */
        close(fd);
        return 0;
    }
    char buf[TOKEN_MAX];
    ssize_t got = read(fd, buf, want);
    close(fd);
    if (got != (ssize_t)want || memcmp(buf, token, want) != 0) {
        say("ficc-barrier: marker holds another token\n");
        return EXIT_MARKER_TOKEN;
    }
    return 1;
}

/* Directory part of an absolute path, for the inotify watch. */
static int parent_of(const char *path, char *out, size_t size) {
    const char *slash = strrchr(path, '/');
    if (slash == NULL || path[0] != '/') return -1;
    size_t len = slash == path ? 1 : (size_t)(slash - path);
    if (len >= size) return -1;
    memcpy(out, path, len);
    out[len] = '\0';
    return 0;
}

static int wait_for_marker(const char *marker, const char *token) {
    char dir[PATH_MAX];
    if (parent_of(marker, dir, sizeof dir) != 0) return EXIT_USAGE;
    int in = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    /* Without inotify we still poll; the watch only makes the wake-up prompt. */
    if (in >= 0 && inotify_add_watch(in, dir, IN_CREATE | IN_MOVED_TO | IN_CLOSE_WRITE) < 0) {
        close(in);
        in = -1;
    }
    for (;;) {
        int state = check_marker(marker, token);
        if (state != 0) {
            if (in >= 0) close(in);
            return state == 1 ? 0 : state;
        }
        struct pollfd p = {.fd = in, .events = POLLIN};
        int n = poll(in >= 0 ? &p : NULL, in >= 0 ? 1 : 0, 200);
        if (n < 0 && errno != EINTR) {
            say("ficc-barrier: wait failed\n");
            return EXIT_WAIT_FAILED;
        }
        if (n > 0) {
            char drain[4096];
            while (read(in, drain, sizeof drain) > 0) {
            }
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 5 || strcmp(argv[3], "--") != 0 || argv[1][0] != '/' || argv[4][0] != '/' ||
        strlen(argv[2]) == 0 || strlen(argv[2]) > TOKEN_MAX) {
        say("usage: ficc-barrier MARKER TOKEN -- /ABSOLUTE/PROGRAM [ARG...]\n");
        return EXIT_USAGE;
    }
    int rc = wait_for_marker(argv[1], argv[2]);
    if (rc != 0) return rc;
    extern char **environ;
    execve(argv[4], &argv[4], environ);
    say("ficc-barrier: execve of the payload failed\n");
    return EXIT_EXEC_FAILED;
}
